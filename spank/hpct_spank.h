/*
 * hpct-slurm SPANK plugin: shared declarations.
 *
 * The plugin is a thin shim. It owns the user-facing options and their validation (a bad
 * value must be refused by sbatch/srun before a job exists), hands the values to the Prolog
 * through the job-control environment, and sets them in every task. Everything derived from
 * them (shm dir, rendezvous env) is computed once, in Python, by `hpct-slurm task-prolog`.
 */
#ifndef HPCT_SPANK_H
#define HPCT_SPANK_H

#include <slurm/spank.h>

#define HPCT_PATH_MAX 4096

struct hpct_config {
	/* plugstack.conf arguments */
	long default_spares;
	long default_cache_mb; /* -1: not set by the admin */
	char default_rendezvous[16];
	long max_spares;
	long max_cache_mb;
	char hpct[HPCT_PATH_MAX]; /* absolute path of `hpct-slurm`; empty: tasks get no derived env */
	/* the job's values: the defaults, overridden by --hpct-* options */
	long spares;
	long cache_mb; /* -1: neither the admin nor the user set it */
	char rendezvous[16];
};

extern struct hpct_config hpct_cfg;

/* config.c: plugstack arguments and option table */
int hpct_config_load(int ac, char **av);
int hpct_register_options(spank_t sp);

/* allocator.c: sbatch/salloc/srun (allocator and local contexts) */
int hpct_allocator_post_opt(spank_t sp);

/* task.c: slurmstepd (remote context) */
int hpct_task_init(spank_t sp);

#endif
