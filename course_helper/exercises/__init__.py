"""The exercises: each one's kernel and checker, on one checker core.

:mod:`.core` runs a learner's loop under the race sanitizer, counts the host's waits in it and
measures its overlap, naming things as the learner's code does; :mod:`.layer_cake` is notebook
8's exercise (``ch.bake_layer``, ``ch.check_layer_cake``).
"""
from .core import ExerciseError, Verdict, hidden_by_direction
from .layer_cake import LayerCakeError, bake_layer, check_layer_cake, layer_values

__all__ = ["ExerciseError", "Verdict", "hidden_by_direction",
           "LayerCakeError", "bake_layer", "check_layer_cake", "layer_values"]
