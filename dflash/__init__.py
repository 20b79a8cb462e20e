"""DFlash drafter training pipeline."""
