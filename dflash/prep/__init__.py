"""What a run starts from: conversations -> (target-regenerated) samples and held-out
prompts (prepare.py), with the regeneration itself (regenerate.py). Above data/ and model/."""
