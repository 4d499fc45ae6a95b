"""Rollway's control plane (``/admin/v1``): tasks, runners, rewards, models, keys and triplets."""
