"""The class on one server (``make hub``), apart from the course library students import: its accounts
(accounts.py), the course each student's home gets (course.py), the assessment's scores in nbgrader's gradebook
(gradebook.py) and the ``scalelab class`` command (commands.py). Imports go one way: commands uses the others;
gradebook uses accounts; nothing here imports the grader service, which uses accounts."""
