"""The node: model, data, fragments and schedule, outer optimizer, trainers, checkpoints."""
