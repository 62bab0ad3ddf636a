"""Command-line entry points: each module's `main(argv=None)` is a console script (setup.py's entry_points).

megarl-verify imports neither torch nor megatron, so that it starts in a blink (tests/unit/test_layout.py); the
others import what their work needs (torch for a model, nothing heavy for megarl-plan and megarl-prepare-data).
"""
