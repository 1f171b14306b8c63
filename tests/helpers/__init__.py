"""Helpers shared by tests: tiny models and forward-batch builders."""
