/*
 * sbatch / salloc / srun: the validated values go into the job-control environment, where
 * the Prolog reads them as SPANK_HPCT_* (it runs as root before any task exists).
 */
#include <stdio.h>

#include "hpct_spank.h"

int hpct_allocator_post_opt(spank_t sp)
{
	char buf[32];
	spank_err_t rc;

	snprintf(buf, sizeof(buf), "%ld", hpct_cfg.spares);
	rc = spank_job_control_setenv(sp, "HPCT_SPARES", buf, 1);
	if (rc == ESPANK_SUCCESS && hpct_cfg.cache_mb >= 0) {
		snprintf(buf, sizeof(buf), "%ld", hpct_cfg.cache_mb);
		rc = spank_job_control_setenv(sp, "HPCT_CACHE_MB", buf, 1);
	}
	if (rc == ESPANK_SUCCESS)
		rc = spank_job_control_setenv(sp, "HPCT_STORE", hpct_cfg.rendezvous, 1);
	/* srun inside an existing allocation has no job-control env to set: nothing to pass. */
	if (rc != ESPANK_SUCCESS && rc != ESPANK_NOT_LOCAL && rc != ESPANK_NOT_AVAIL) {
		slurm_error("hpct: cannot pass options to the prolog: %s", spank_strerror(rc));
		return -1;
	}
	return 0;
}
