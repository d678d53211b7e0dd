"""Config, weights, model layers, state pool, step buffers, scheduler, sampling and the Engine."""
