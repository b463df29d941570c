"""The arithmetic of distributed training: pure functions, units in their names, each formula cited."""
