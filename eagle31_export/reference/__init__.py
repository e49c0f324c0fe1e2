"""PyTorch source of truth: drafter, target with tapped states, speculation loop."""
