"""The exercises: each one's kernel and checker, on one checker core.

:mod:`.core` runs a learner's loop under the race sanitizer, counts the host's waits in it and
measures its overlap, naming things as the learner's code does; :mod:`.layer_cake` is notebook
8's exercise (``ch.bake_layer``, ``ch.check_layer_cake``); :mod:`.cake_graph` notebook 10's (the
cake captured into a graph, ``check_cake_graph``); :mod:`.on_your_own` the checks of the
"On your own" cells of notebooks 2, 3, 6 and 9; :mod:`.capstone` notebook 13's problem (Gray-Scott
reaction-diffusion, data streamed both ways), its kernel and its checker.
"""
from .cake_graph import cake_kit, cake_loop, check_cake_graph
from .capstone import (CapstoneError, GrayScott, check_capstone, check_depths, launch_gray_scott,
                       reference_snapshots, sequential_snapshots)
from .core import ExerciseError, Verdict, hidden_by_direction
from .layer_cake import LayerCakeError, bake_layer, check_layer_cake, layer_values
from .on_your_own import check_copy_after_kernels, check_race_fix, check_ring_depth, check_speedup

__all__ = ["ExerciseError", "Verdict", "hidden_by_direction",
           "LayerCakeError", "bake_layer", "check_layer_cake", "layer_values",
           "cake_loop", "cake_kit", "check_cake_graph",
           "check_copy_after_kernels", "check_speedup", "check_ring_depth", "check_race_fix",
           "GrayScott", "launch_gray_scott", "reference_snapshots", "sequential_snapshots", "check_capstone",
           "check_depths", "CapstoneError"]
