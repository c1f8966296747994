/*
 * slurmstepd, in each task just before exec: set the option values, then (when the admin
 * named `hpct=` in plugstack.conf) run `hpct-slurm task-prolog` with the task's environment
 * and apply the `export NAME=VALUE` lines it prints. The derivation (shm dir, rendezvous env)
 * lives only in that Python command, shared with the TaskProlog= path.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include "hpct_spank.h"

#define OUTPUT_MAX (256 * 1024)

static int set_long(spank_t sp, const char *name, long v)
{
	char buf[32];

	snprintf(buf, sizeof(buf), "%ld", v);
	return spank_setenv(sp, name, buf, 1) == ESPANK_SUCCESS ? 0 : -1;
}

static int valid_name(const char *s, size_t n)
{
	if (n == 0 || (s[0] >= '0' && s[0] <= '9'))
		return 0;
	for (size_t i = 0; i < n; i++) {
		char c = s[i];
		if (!((c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') ||
		      (c >= '0' && c <= '9') || c == '_'))
			return 0;
	}
	return 1;
}

/* Apply `export NAME=VALUE` lines; anything else (comments, blank lines) is skipped. */
static int apply_exports(spank_t sp, char *out)
{
	char *save = NULL;

	for (char *line = strtok_r(out, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
		char *eq;

		if (strncmp(line, "export ", 7) != 0)
			continue;
		line += 7;
		eq = strchr(line, '=');
		if (eq == NULL || !valid_name(line, (size_t)(eq - line))) {
			slurm_error("hpct: task env line 'export %s' is not NAME=VALUE", line);
			return -1;
		}
		*eq = '\0';
		if (spank_setenv(sp, line, eq + 1, 1) != ESPANK_SUCCESS) {
			slurm_error("hpct: cannot set %s in the task environment", line);
			return -1;
		}
	}
	return 0;
}

static int run_task_env(spank_t sp)
{
	char **env = NULL;
	char *out;
	int fds[2], status;
	size_t used = 0;
	ssize_t n;
	pid_t pid;

	if (spank_get_item(sp, S_JOB_ENV, &env) != ESPANK_SUCCESS) {
		slurm_error("hpct: cannot read the task environment");
		return -1;
	}
	if (pipe(fds) != 0) {
		slurm_error("hpct: pipe: %s", strerror(errno));
		return -1;
	}
	pid = fork();
	if (pid < 0) {
		slurm_error("hpct: fork: %s", strerror(errno));
		close(fds[0]);
		close(fds[1]);
		return -1;
	}
	if (pid == 0) {
		char *argv[] = { hpct_cfg.hpct, "task-prolog", NULL };

		dup2(fds[1], STDOUT_FILENO);
		close(fds[0]);
		close(fds[1]);
		execve(hpct_cfg.hpct, argv, env);
		/* the task's stderr: the user sees why (e.g. a python the job user cannot read) */
		dprintf(STDERR_FILENO, "hpct: cannot run %s: %s\n", hpct_cfg.hpct, strerror(errno));
		_exit(127);
	}
	close(fds[1]);
	out = malloc(OUTPUT_MAX + 1);
	if (out == NULL) {
		close(fds[0]);
		waitpid(pid, &status, 0);
		return -1;
	}
	while (used < OUTPUT_MAX &&
	       ((n = read(fds[0], out + used, OUTPUT_MAX - used)) > 0 || (n < 0 && errno == EINTR)))
		if (n > 0)
			used += (size_t)n;
	out[used] = '\0';
	close(fds[0]);
	while (waitpid(pid, &status, 0) < 0 && errno == EINTR)
		;
	if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
		slurm_error("hpct: %s task-prolog failed (%s %d)", hpct_cfg.hpct,
			    WIFEXITED(status) ? "exit code" : "signal",
			    WIFEXITED(status) ? WEXITSTATUS(status) : WTERMSIG(status));
		free(out);
		return -1;
	}
	n = apply_exports(sp, out);
	free(out);
	return (int)n;
}

int hpct_task_init(spank_t sp)
{
	char ctl[8];
	/* HPCT_STORE is a rank-side setting: in a rank the controller launched (HPCT_CONTROLLER
	 * set in its step) the controller's value stands, whatever `controller --store` chose;
	 * the plugin sets it only elsewhere (the batch script, plain srun steps). */
	int from_controller = spank_getenv(sp, "HPCT_CONTROLLER", ctl, sizeof(ctl)) !=
			      ESPANK_ENV_NOEXIST;

	if (set_long(sp, "HPCT_SPARES", hpct_cfg.spares) != 0 ||
	    (hpct_cfg.cache_mb >= 0 && set_long(sp, "HPCT_CACHE_MB", hpct_cfg.cache_mb) != 0) ||
	    (!from_controller &&
	     spank_setenv(sp, "HPCT_STORE", hpct_cfg.rendezvous, 1) != ESPANK_SUCCESS)) {
		slurm_error("hpct: cannot set HPCT_* in the task environment");
		return -1;
	}
	if (hpct_cfg.hpct[0] == '\0')
		return 0;
	return run_task_env(sp);
}
