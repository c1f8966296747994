"""Rank side of recovery: snapshots, replicas, peer transfer, disk persistence."""
