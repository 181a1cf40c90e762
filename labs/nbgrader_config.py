"""nbgrader course configuration: this directory is the course (sources in source/, releases in release/, …)."""

import os

from nbgrader.converters import Autograde

from scalelab.grader.nbgrading.sandboxed_execute import with_sandboxed_execute

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

# What a student's notebook shows is rendered for the instructor (formgrader) and for the student (feedback) with its
# HTML sanitised: an output or a Markdown cell cannot run a script on the instructor's page.
c.HTMLExporter.sanitize_html = True

# Autograding runs each notebook without a browser: nbgrader's own steps, with its Execute swapped for one whose
# kernel runs in the grading sandbox (a throw-away uid, no network, no secret, a copy of the notebook's folder;
# scalelab.grader.nbgrading.kernel_sandbox) and whose client does not hang when a wake-up from the kernel's socket
# is lost (lab 1's slider triggers it; scalelab.headless).
c.Autograde.autograde_preprocessors = with_sandboxed_execute(
    Autograde.class_traits()["autograde_preprocessors"].default())
# Each notebook's kernel, with everything it starts: at most this long and this much memory.
c.SandboxedKernelManager.time_limit_s = 1800
c.SandboxedKernelManager.memory_limit_bytes = 6 * 1024**3

# Lab 3's students (both editions) hand in their converted script next to the notebook. Autograding puts the source
# folder's files back over a submission's; this one must stay the student's (the released copy holds only FIXMEs).
c.Autograde.exclude_overwriting = {"lab3": ["fashion_mnist_student.py"],
                                   "lab3_ddp": ["fashion_mnist_ddp_student.py"]}
# ... and grading runs that script for one short epoch on two ranks (15–30 s on 2 cores): nbgrader's default limit
# of 30 s a cell is too tight for it on a busy machine.
c.Execute.timeout = 300
# After a cell ends (or is interrupted at its timeout), its last outputs may take a while on a busy machine.
c.Execute.iopub_timeout = 30
