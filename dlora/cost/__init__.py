"""The step-time model: one line for what a step of continuous batching costs, and its fit."""
