"""Integrations of shmkv with serving engines."""
