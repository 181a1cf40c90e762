"""nbgrader's configuration for everyone on the class's Hub (`make hub`). hub.sh installs it in the shared venv as
HUB_VENV/etc/jupyter/nbgrader_config.py, with NBGRADER_HOME set to HUB_NBGRADER, so that every nbgrader run from
that venv reads it: the Assignments tab of each server, and `nbgrader` typed in a terminal.

Everyone: the course id and nbgrader's exchange, NBGRADER_HOME/exchange (1777, as nbgrader documents; the course's
inbound is write-only for students), and the course's own `nbgrader collect`, which takes from inbound only what a
student can have submitted honestly. Instructors, the members of the Unix group scalelab-instructors: also the
class's one course directory, NBGRADER_HOME/course (sources, submissions, the gradebook; the group's alone), with
its own nbgrader_config.py (a copy of labs/nbgrader_config.py) and nbgrader's groupshared permissions, so that any
instructor can carry on what another one started.
"""

import grp
import os

from scalelab.grader.classroom.accounts import ROLE_GROUPS

NBGRADER_HOME = "/srv/nbgrader"  # hub.sh writes HUB_NBGRADER here

c = get_config()  # noqa: F821 — provided by nbgrader when it loads this file

c.CourseDirectory.course_id = "scalelab"
c.Exchange.root = os.path.join(NBGRADER_HOME, "exchange")
# Students can write anything into inbound/: collect only what each of them really submitted (no links, owner and
# time checked, one bad folder skipped rather than the whole class stopped; grader/nbgrading/exchange.py says how).
c.ExchangeFactory.collect = "scalelab.grader.nbgrading.exchange.SafeExchangeCollect"

try:
    instructors_gid = grp.getgrnam(ROLE_GROUPS["instructor"]).gr_gid
except KeyError:
    instructors_gid = None
if instructors_gid is not None and instructors_gid in os.getgroups():
    load_subconfig("nbgrader_config.py", os.path.join(NBGRADER_HOME, "course"))  # noqa: F821 — from traitlets
    # Files nbgrader writes are group-writable, its directories setgid: the group scalelab-instructors owns them.
    c.CourseDirectory.groupshared = True
    # The same directory through ~/nbgrader-course (the Hub links it before each start of an instructor's server):
    # the formgrader needs the course inside the server's root, the home.
    in_home = os.path.expanduser("~/nbgrader-course")
    if os.path.realpath(in_home) == os.path.realpath(os.path.join(NBGRADER_HOME, "course")):
        c.CourseDirectory.root = in_home
