"""nbgrader course configuration: this directory is the course (sources in source/, releases in release/, …)."""

import os

c = get_config()  # noqa: F821 — provided by nbgrader when it loads this file

course_root = os.path.dirname(os.path.abspath(__file__))
c.CourseDirectory.course_id = "scalelab"
c.CourseDirectory.root = course_root
c.CourseDirectory.db_url = "sqlite:///" + os.path.join(course_root, "gradebook.db")

# Feedback shows each test's result and message, not the hidden tests' source (it holds the answer key).
c.GenerateFeedback.preprocessors = [
    "nbgrader.preprocessors.GetGrades",
    "nbgrader.preprocessors.ClearHiddenTests",
    "nbconvert.preprocessors.CSSHTMLHeaderPreprocessor",
]
