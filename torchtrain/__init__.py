"""torchtrain: the production PyTorch trainer on stock Hugging Face transformers models."""
