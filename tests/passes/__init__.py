"""Tests of graph_trainer.compiler.passes, one ``test_<pass>.py`` per pass."""
