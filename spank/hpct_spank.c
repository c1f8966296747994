/*
 * Dispatch only: each SPANK hook is routed by context to the file that owns that context
 * (config.c: every context; allocator.c: sbatch/salloc/srun; task.c: slurmstepd).
 */
#include "hpct_spank.h"

SPANK_PLUGIN(hpct, 1);

int slurm_spank_init(spank_t sp, int ac, char **av)
{
	/* Options must be registered in every context that parses them, including
	 * allocator (sbatch) where the static spank_options table is not read. */
	switch (spank_context()) {
	case S_CTX_LOCAL:
	case S_CTX_ALLOCATOR:
	case S_CTX_REMOTE:
		if (hpct_config_load(ac, av) != 0)
			return -1;
		return hpct_register_options(sp);
	default:
		return 0;
	}
}

int slurm_spank_init_post_opt(spank_t sp, int ac, char **av)
{
	(void)ac;
	(void)av;
	switch (spank_context()) {
	case S_CTX_LOCAL:
	case S_CTX_ALLOCATOR:
		return hpct_allocator_post_opt(sp);
	default:
		return 0;
	}
}

int slurm_spank_task_init(spank_t sp, int ac, char **av)
{
	(void)ac;
	(void)av;
	if (spank_context() != S_CTX_REMOTE)
		return 0;
	return hpct_task_init(sp);
}
