"""Mesh, logical axis rules and sharding helpers."""
