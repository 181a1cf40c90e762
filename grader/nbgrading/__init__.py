"""Grading the labs (nbgrader): the exchange's collect and the sandbox students' notebooks run in."""
