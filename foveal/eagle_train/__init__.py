"""Training EAGLE-3 draft heads for a target (`foveal train-eagle`)."""
