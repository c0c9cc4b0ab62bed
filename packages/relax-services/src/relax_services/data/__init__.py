"""A run's data: its dataset files (a user's or the synthetic ones), the prompts built from their rows, each
task's chance level, and the feeder that puts prompts into the queue with its exact ledger."""
