"""Merge strategies, registered as plug-ins."""
