"""Task generators: problems as jsonl rows `{"id", "prompt", "answer", "verifier"}`. Pure python, no torch."""
