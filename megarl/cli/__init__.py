"""Command-line entry points. Kept free of torch and megatron imports so that they start in a blink."""
