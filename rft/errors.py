"""The one error type for user mistakes.

A `ConfigError` carries a message that names the key, file or line at fault and the fix. The
entry point prints it as one paragraph and exits with status 2, without a traceback.
"""


class ConfigError(Exception):
    """A mistake in the config or the data that the user can fix."""


class RunError(Exception):
    """A run that cannot go on (an actor died for good): the message says what is saved and how to resume.

    The entry point prints it as one paragraph and exits with status 1.
    """
