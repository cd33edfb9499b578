"""Datasets: local JSON Lines folders, files and hub ids through the datasets library."""
