/*
 * plugstack.conf arguments and the --hpct-* options: parsing and strict validation.
 *
 *   required /path/hpct_spank.so [default_spares=N] [default_cache_mb=M]
 *            [default_rendezvous=rootless|tcpstore] [max_spares=N] [max_cache_mb=M]
 *            [hpct=/abs/path/hpct-slurm]
 *
 * An unknown key is an error, not ignored: a typo would otherwise silently change behaviour.
 */
#include <errno.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>

#include "hpct_spank.h"

struct hpct_config hpct_cfg;

enum { OPT_SPARES = 1, OPT_CACHE_MB, OPT_RENDEZVOUS };

static const char *const rendezvous_kinds[] = { "rootless", "tcpstore", NULL };

/* A decimal integer in [lo, hi] with nothing around it: no sign, no spaces, no suffix. */
static int parse_long(const char *s, long lo, long hi, long *out)
{
	char *end = NULL;
	long v;

	if (s == NULL || *s < '0' || *s > '9')
		return -1;
	errno = 0;
	v = strtol(s, &end, 10);
	if (errno != 0 || *end != '\0' || v < lo || v > hi)
		return -1;
	*out = v;
	return 0;
}

static int valid_rendezvous(const char *s)
{
	for (int i = 0; rendezvous_kinds[i]; i++)
		if (s && strcmp(s, rendezvous_kinds[i]) == 0)
			return 1;
	return 0;
}

static int copy_str(char *dst, size_t len, const char *src)
{
	if (strlen(src) >= len)
		return -1;
	strcpy(dst, src);
	return 0;
}

static int conf_long(const char *key, const char *val, long hi, long *out)
{
	if (parse_long(val, 0, hi, out) != 0) {
		slurm_error("hpct: plugstack.conf %s='%s' is not an integer in 0..%ld", key, val, hi);
		return -1;
	}
	return 0;
}

int hpct_config_load(int ac, char **av)
{
	memset(&hpct_cfg, 0, sizeof(hpct_cfg));
	hpct_cfg.max_spares = 64;
	hpct_cfg.max_cache_mb = 1024 * 1024;
	/* unset: the prolog then applies the site default (HPCT_DEFAULT_CACHE_MB) */
	hpct_cfg.default_cache_mb = -1;
	strcpy(hpct_cfg.default_rendezvous, "rootless");

	for (int i = 0; i < ac; i++) {
		char *eq = strchr(av[i], '=');
		const char *val;
		size_t klen;
		int rc = 0;

		if (eq == NULL) {
			slurm_error("hpct: plugstack.conf argument '%s' is not key=value", av[i]);
			return -1;
		}
		klen = (size_t)(eq - av[i]);
		val = eq + 1;
#define KEY(k) (klen == strlen(k) && strncmp(av[i], k, klen) == 0)
		if (KEY("default_spares"))
			rc = conf_long("default_spares", val, INT_MAX, &hpct_cfg.default_spares);
		else if (KEY("default_cache_mb"))
			rc = conf_long("default_cache_mb", val, INT_MAX, &hpct_cfg.default_cache_mb);
		else if (KEY("max_spares"))
			rc = conf_long("max_spares", val, INT_MAX, &hpct_cfg.max_spares);
		else if (KEY("max_cache_mb"))
			rc = conf_long("max_cache_mb", val, INT_MAX, &hpct_cfg.max_cache_mb);
		else if (KEY("default_rendezvous")) {
			if (!valid_rendezvous(val)) {
				slurm_error("hpct: plugstack.conf default_rendezvous='%s' is not "
					    "rootless or tcpstore", val);
				return -1;
			}
			strcpy(hpct_cfg.default_rendezvous, val);
		} else if (KEY("hpct")) {
			if (val[0] != '/' || copy_str(hpct_cfg.hpct, sizeof(hpct_cfg.hpct), val)) {
				slurm_error("hpct: plugstack.conf hpct='%s' is not an absolute path", val);
				return -1;
			}
		} else {
			slurm_error("hpct: plugstack.conf has unknown key '%.*s' (known: "
				    "default_spares default_cache_mb default_rendezvous max_spares "
				    "max_cache_mb hpct)", (int)klen, av[i]);
			return -1;
		}
#undef KEY
		if (rc != 0)
			return -1;
	}
	if (hpct_cfg.default_spares > hpct_cfg.max_spares ||
	    hpct_cfg.default_cache_mb > hpct_cfg.max_cache_mb) {
		slurm_error("hpct: plugstack.conf defaults exceed max_spares=%ld/max_cache_mb=%ld",
			    hpct_cfg.max_spares, hpct_cfg.max_cache_mb);
		return -1;
	}
	hpct_cfg.spares = hpct_cfg.default_spares;
	hpct_cfg.cache_mb = hpct_cfg.default_cache_mb;
	strcpy(hpct_cfg.rendezvous, hpct_cfg.default_rendezvous);
	return 0;
}

/* Called by srun/sbatch (remote=0) and again in slurmstepd (remote=1) with the same value. */
static int option_cb(int val, const char *optarg, int remote)
{
	(void)remote;
	switch (val) {
	case OPT_SPARES:
		if (parse_long(optarg, 0, hpct_cfg.max_spares, &hpct_cfg.spares) != 0) {
			slurm_error("hpct: --hpct-spares '%s' is not an integer in 0..%ld",
				    optarg ? optarg : "", hpct_cfg.max_spares);
			return -1;
		}
		return 0;
	case OPT_CACHE_MB:
		if (parse_long(optarg, 0, hpct_cfg.max_cache_mb, &hpct_cfg.cache_mb) != 0) {
			slurm_error("hpct: --hpct-cache-mb '%s' is not an integer in 0..%ld",
				    optarg ? optarg : "", hpct_cfg.max_cache_mb);
			return -1;
		}
		return 0;
	case OPT_RENDEZVOUS:
		if (!valid_rendezvous(optarg)) {
			slurm_error("hpct: --hpct-rendezvous '%s' is not rootless or tcpstore",
				    optarg ? optarg : "");
			return -1;
		}
		strcpy(hpct_cfg.rendezvous, optarg);
		return 0;
	}
	return -1;
}

static struct spank_option options[] = {
	{ "hpct-spares", "N", "hpct: hot-spare nodes held by this job", 1, OPT_SPARES, option_cb },
	{ "hpct-cache-mb", "MB", "hpct: per-node shared-memory data cache budget", 1,
	  OPT_CACHE_MB, option_cb },
	{ "hpct-rendezvous", "rootless|tcpstore", "hpct: rendezvous kind", 1, OPT_RENDEZVOUS,
	  option_cb },
	SPANK_OPTIONS_TABLE_END
};

int hpct_register_options(spank_t sp)
{
	for (struct spank_option *o = options; o->name; o++) {
		spank_err_t rc = spank_option_register(sp, o);
		if (rc != ESPANK_SUCCESS) {
			slurm_error("hpct: cannot register --%s: %s", o->name, spank_strerror(rc));
			return -1;
		}
	}
	return 0;
}
