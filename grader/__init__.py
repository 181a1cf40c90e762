"""ScaleLab grader."""
