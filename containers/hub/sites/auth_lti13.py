"""LTI 1.3: the class logs in from its course in an LMS (Canvas, Moodle, Blackboard, Open edX, ...).

A jupyterhub_config.d-style fragment: it expects `c` and overrides what containers/hub/jupyterhub_config.py set
(the authenticator, and how instructors become the Hub group `instructors`). Not tested here: `make hub` is tested
with PAM only. Needs jupyterhub-ltiauthenticator==1.6.3 in the Hub's environment; see sites/README.md.

Instructors are the launches whose LTI roles claim says Instructor in the course (context membership), at every
launch. nbgrader's course directory follows the Unix group scalelab-instructors, not this Hub group: create
instructors with `scalelab class add-instructor`.
"""

from tornado import web

# --- this site: from the LMS's registration of the tool ---------------------------------------------------------
LMS_ISSUER = "https://lms.example.edu"  # Canvas cloud: https://canvas.instructure.com
LMS_CLIENT_IDS = {"10000000000001"}
# Moodle: https://lms.example.edu/mod/lti/auth.php and .../mod/lti/certs.php;
# Canvas: https://lms.example.edu/api/lti/authorize_redirect and .../api/lti/security/jwks.
LMS_AUTHORIZE_URL = "https://lms.example.edu/mod/lti/auth.php"
LMS_JWKS_URL = "https://lms.example.edu/mod/lti/certs.php"
# make hub (LocalProcessSpawner): a Hub user's server runs as the system account of the same name, so a launch
# without one is refused here with a sentence rather than failing at spawn. False under TLJH or Kubernetes.
REQUIRE_CLASS_ACCOUNT = True

# The Hub group the class page admits (scalelab.grader.classroom.accounts.HUB_INSTRUCTORS_GROUP).
INSTRUCTORS_GROUP = "instructors"
ROLES_CLAIM = "https://purl.imsglobal.org/spec/lti/claim/roles"
# Add "http://purl.imsglobal.org/vocab/lis/v2/membership/Instructor#TeachingAssistant" to let TAs in.
INSTRUCTOR_ROLES = {"http://purl.imsglobal.org/vocab/lis/v2/membership#Instructor"}

# `c`: the config being loaded. Every loader of such files defines it: JupyterHub's, make hub's HUB_CONFIG_D,
# TLJH's load_subconfig, and the Helm chart's exec of hub.extraConfig (z2jh, where get_config is a function of
# its own).

c.JupyterHub.authenticator_class = "ltiauthenticator.lti13.auth.LTI13Authenticator"
c.LTI13Authenticator.issuer = LMS_ISSUER
c.LTI13Authenticator.client_id = LMS_CLIENT_IDS
c.LTI13Authenticator.authorize_url = LMS_AUTHORIZE_URL
c.LTI13Authenticator.jwks_endpoint = LMS_JWKS_URL
# The Hub user name: the custom parameter `username`, which the tool's registration sets to `$User.username`
# (the LMS's login name). The default, `email`, can never be a system account's name.
c.LTI13Authenticator.username_key = "custom_username"
# LTI 1.3 needs HTTPS; say so when the TLS front end does not send X-Forwarded-Proto.
c.LTI13Authenticator.uri_scheme = "https"
# Whom the LMS launches may come in (JupyterHub 5 lets nobody in without an allow rule); the hook below narrows
# that to the class's accounts.
c.LTI13Authenticator.allow_all = True


def class_member_from_lms(authenticator, handler, authentication):
    """The launch's LTI roles decide the Hub group `instructors`; under make hub, the account must exist."""
    name = authentication["name"]
    if REQUIRE_CLASS_ACCOUNT:
        from scalelab.grader.classroom.accounts import role_of

        if role_of(name) is None:
            raise web.HTTPError(403, f"{name} has no account in this class on the server: ask an instructor to "
                                     f"run `scalelab class add-student {name}` as root.")
    roles = set((authentication.get("auth_state") or {}).get(ROLES_CLAIM) or [])
    authentication["groups"] = [INSTRUCTORS_GROUP] if roles & INSTRUCTOR_ROLES else []
    return authentication


c.Authenticator.manage_groups = True
c.Authenticator.post_auth_hook = class_member_from_lms
