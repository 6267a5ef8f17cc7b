"""Offline batch jobs: OpenAI's Files and Batches API and `dlora batch run` (map: docs/batch.md)."""
