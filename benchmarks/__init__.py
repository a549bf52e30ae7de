"""Developer harnesses beside the package (not in the wheel), run by nox."""
