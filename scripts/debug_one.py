import os, sys, faulthandler
sys.path.insert(0, os.getcwd())


def main():
    faulthandler.enable()
    os.environ["MOE_EP_TIMEOUT_S"] = "10"
    from moe_ep.launch import RankPool
    from tests import rank_fns
    from tests.problems import Problem
    p = Problem(5, 2, 16, 256, 4, max_tokens=64)
    with RankPool(2, use_cuda=True, env={"MOE_EP_TEST_CUDA": "1"}) as pool:
        out = pool.run(rank_fns.normal_round, p, use_fp8=False)
        print("OK", [o["recv_x"].shape for o in out])


if __name__ == "__main__":
    main()
