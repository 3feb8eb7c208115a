"""Test bodies: functions that run inside tests.harness launches (one process per rank)."""
