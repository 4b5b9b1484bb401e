"""Configuration: the run's nested dataclasses (one docstring a field, Literal choices), YAML loading with
dotted overrides, and the checks that need no Ray or torch."""
