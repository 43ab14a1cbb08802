"""Replicas on Ray Serve (`specserve serve --replicas N`): docs/scaling.md.

Only `affinity` and `flags` import without Ray; the rest needs the `cluster` extra
(`make setup-cluster`).
"""
