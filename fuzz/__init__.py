"""Coverage-guided fuzz targets (atheris) for every host-side parser of
guest traffic. Not part of the test run: `./run fuzz [--minutes N] [TARGET]`."""
