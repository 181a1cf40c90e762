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

# Autograding runs each notebook without a browser; scalelab.headless.Execute is nbgrader's Execute with a kernel
# client that does not hang when a wake-up from the kernel's socket is missed (lab 1's slider triggers it).
c.Autograde.autograde_preprocessors = [
    "scalelab.headless.Execute",
    "nbgrader.preprocessors.IgnorePattern",
    "nbconvert.preprocessors.ClearMetadataPreprocessor",
    "nbgrader.preprocessors.LimitOutput",
    "nbgrader.preprocessors.SaveAutoGrades",
    "nbgrader.preprocessors.AssignLatePenalties",
    "nbgrader.preprocessors.CheckCellMetadata",
]
