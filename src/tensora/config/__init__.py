"""Configuration: YAML files a person writes (with line numbers in errors), catalog and settings."""
