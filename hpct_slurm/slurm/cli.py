"""placeholder until the slurm package's CLI lands"""


def register(sub):
    pass
