"""Command-line tools: run (the main job), tune (graph buckets), bench."""
