"""README.md's recipes, executed as written (test_readme.py states the convention)."""
