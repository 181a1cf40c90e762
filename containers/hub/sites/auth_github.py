"""GitHub OAuth: the class logs in with GitHub; members of a GitHub organization (or of one of its teams) get in.

A jupyterhub_config.d-style fragment: it expects `c` and overrides what containers/hub/jupyterhub_config.py set
(the authenticator, and how instructors become the Hub group `instructors`). Not tested here: `make hub` is tested
with PAM only. Needs oauthenticator==17.4.0 in the Hub's environment; see sites/README.md. It holds the OAuth
app's secret: keep the copy root's alone (mode 0600).

Instructors are the members of one team of the organization, read from GitHub at each login (scope read:org).
nbgrader's course directory follows the Unix group scalelab-instructors, not this Hub group: create instructors
with `scalelab class add-instructor`.
"""

from tornado import web

# --- this site: the GitHub OAuth app (Settings > Developer settings > OAuth Apps) and the organization --------
HUB_URL = "https://hub.example.edu"
GITHUB_CLIENT_ID = "Ov23li0000000000000"
GITHUB_CLIENT_SECRET = "CHANGE-ME"
ORGANIZATION = "example-course"
INSTRUCTOR_TEAM = "example-course:instructors"  # organization:team-slug, as in the team's URL
# make hub (LocalProcessSpawner): a Hub user's server runs as the system account of the same name, so a login
# without one is refused here with a sentence rather than failing at spawn. Set False under TLJH or Kubernetes,
# or with CREATE_SYSTEM_USERS.
REQUIRE_CLASS_ACCOUNT = True
# True: JupyterHub creates the missing account at first login (`adduser -q --gecos "" --disabled-password NAME`;
# not in the group scalelab-students, no password) instead of `scalelab class add-student` beforehand.
CREATE_SYSTEM_USERS = False

# The Hub group the class page admits (scalelab.grader.classroom.accounts.HUB_INSTRUCTORS_GROUP).
INSTRUCTORS_GROUP = "instructors"

# `c`: the config being loaded. Every loader of such files defines it: JupyterHub's, make hub's HUB_CONFIG_D,
# TLJH's load_subconfig, and the Helm chart's exec of hub.extraConfig (z2jh, where get_config is a function of
# its own).

if CREATE_SYSTEM_USERS:
    c.JupyterHub.authenticator_class = "local-github"
    c.LocalGitHubOAuthenticator.create_system_users = True
else:
    c.JupyterHub.authenticator_class = "github"
c.GitHubOAuthenticator.oauth_callback_url = f"{HUB_URL}/hub/oauth_callback"
c.GitHubOAuthenticator.client_id = GITHUB_CLIENT_ID
c.GitHubOAuthenticator.client_secret = GITHUB_CLIENT_SECRET
c.GitHubOAuthenticator.allowed_organizations = {ORGANIZATION}
# read:org: private memberships count, and the user's teams can be listed.
c.GitHubOAuthenticator.scope = ["read:org"]
c.GitHubOAuthenticator.populate_teams_in_auth_state = True


def instructors_from_teams(auth_state):
    """The Hub groups of a GitHub user: `instructors` for the members of INSTRUCTOR_TEAM."""
    teams = {f"{team['organization']['login']}:{team['slug']}".lower() for team in auth_state.get("teams") or []}
    return [INSTRUCTORS_GROUP] if INSTRUCTOR_TEAM.lower() in teams else []


c.GitHubOAuthenticator.manage_groups = True
c.GitHubOAuthenticator.auth_state_groups_key = instructors_from_teams


def class_account_required(authenticator, handler, authentication):
    """Under make hub, only a Hub user with a class account (`scalelab class add-*`) can start a server."""
    from scalelab.grader.classroom.accounts import role_of

    name = authentication["name"]
    if role_of(name) is None:
        raise web.HTTPError(403, f"{name} has no account in this class on the server: ask an instructor to run "
                                 f"`scalelab class add-student {name}` as root.")
    return authentication


# Replaces jupyterhub_config.py's hook, which would set the groups from the Unix group instead of the team.
c.Authenticator.post_auth_hook = class_account_required if REQUIRE_CLASS_ACCOUNT else None
