"""Training one way: config, set-up before the weights, the Trainer, the entry point, step, loss, optimiser, metrics."""
