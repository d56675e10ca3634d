from pdcluster import constants as C
from pdcluster.render import engine
from pdcluster.vllm import kvtransfer as kvt
from pdcluster.vllm.hashing import leading_cached_run


def test_kv_events_config_binds_all_interfaces_on_both_ports():
    config = kvt.kv_events_config(5557, 5558)
    assert config == {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": "tcp://*:5557",
        "replay_endpoint": "tcp://*:5558",
    }


def test_render_uses_the_kv_roles_of_vllm():
    assert engine.KV_ROLE == {
        C.ROLE_PREFILL: "kv_producer",
        C.ROLE_DECODE: "kv_consumer",
        C.ROLE_FLEXIBLE: "kv_both",
    }
    assert engine.STORE_KV_ROLE == {
        C.ROLE_PREFILL: "kv_both",
        C.ROLE_DECODE: "kv_consumer",
        C.ROLE_FLEXIBLE: "kv_both",
    }
    assert set(kvt.WRITING_ROLES) | set(kvt.LOADING_ROLES) == set(kvt.KV_ROLES)


def test_leading_cached_run_never_covers_the_last_token():
    assert leading_cached_run(0, 16, 100) == 0
    assert leading_cached_run(2, 16, 100) == 32
    assert leading_cached_run(6, 16, 100) == 96  # all full blocks of a 100-token prompt
    assert leading_cached_run(4, 16, 64) == 48  # a whole-block prompt recomputes its last block
    assert leading_cached_run(1, 16, 16) == 0
