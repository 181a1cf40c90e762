"""nbgrader course configuration: this directory is the course (sources in source/, releases in release/, …)."""

import os

from nbgrader.converters import Autograde

from scalelab.headless import with_polling_execute

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

# Autograding runs each notebook without a browser: nbgrader's own steps, with its Execute swapped for one whose
# kernel client does not hang when a wake-up from the kernel's socket is lost (lab 1's slider triggers it).
c.Autograde.autograde_preprocessors = with_polling_execute(
    Autograde.class_traits()["autograde_preprocessors"].default())
