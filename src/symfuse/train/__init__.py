"""Fine-tuning."""
