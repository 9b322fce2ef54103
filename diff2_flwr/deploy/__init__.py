"""Deployment: shard files for data owners, certificates and node keys, docker-compose files, and
the native multi-process deployment on one machine. Built on ``runtime``; never imported by it."""
