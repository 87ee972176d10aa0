"""Agent keys: checked by the schema, and what they point at checked before Ray starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlframe.config import AgentConfig, Config, ConfigError, RolloutConfig
from rlframe.config.agent import compute_response_width
from tests.unit.cli_errors import check_config_error

TEMPLATE_LESS_ENV = Path(__file__).resolve().parent / "scripted_episodes.py"


@pytest.mark.parametrize(
    "override,message",
    [
        (
            "rollout.agent=no_such_pkg.agents:mine",
            "rollout.agent: cannot be loaded: ModuleNotFoundError",
        ),
        (
            "rollout.agent=three_turn",
            "rollout.agent: unknown rollout agent 'three_turn'; registered: ['multi_turn', "
            "'openai', 'single_turn']",
        ),
        (
            "agent.env=chess",
            "agent.env: unknown environment 'chess'; registered: "
            "['calculator', 'colour_quiz', 'guess_number', 'slow_guess']",
        ),
        (
            "rollout.agent=tests.plugins.old_agents:collated",
            "rollout.agent: tests.plugins.old_agents:collated is declared to return a Batch: "
            "an agent returns its rows",
        ),
        (f"agent.env={TEMPLATE_LESS_ENV}:NoSuchEnv", "agent.env: has no function 'NoSuchEnv'"),
        ("+agent.env_kwargs.colour=red", "agent.env_kwargs: guess_number cannot be built with"),
        (
            "agent.on_env_error=ignore",
            "agent.on_env_error: must be one of ['raise', 'mask', 'fail_episode']",
        ),
        ("+agent.max_turn=3", "agent.max_turn: unknown key; keys allowed in agent:"),
        (
            "agent.max_obs_tokens=256",
            "agent.max_obs_tokens: data.max_prompt_length 16 + rollout.max_tokens 4 + "
            "(agent.max_turns - 1) * agent.max_obs_tokens = 768 = 788 tokens exceeds the model's "
            "512 positions",
        ),
    ],
)
def test_bad_agent_inputs_fail_before_ray_with_one_line(override: str, message: str) -> None:
    key, text = message.split(": ", 1)
    check_config_error("+recipe=agent_tiny", override, key=key, text=text)


@pytest.mark.parametrize(
    "overrides,message",
    [
        ([], "agent.entry: rollout.agent=openai needs the agent's function"),
        (["agent.entry=no_such_pkg.agents:play"], "agent.entry: cannot be loaded"),
        (["agent.server_port=70000"], "agent.server_port: must be in [0, 65535]"),
        (["agent.max_pending_requests=0"], "agent.max_pending_requests: must be > 0"),
    ],
)
def test_bad_openai_agent_inputs_fail_before_ray(overrides: list[str], message: str) -> None:
    key, text = message.split(": ", 1)
    check_config_error("+recipe=agent_tiny", "rollout.agent=openai", *overrides, key=key, text=text)


def test_multi_turn_needs_an_env_and_widens_responses() -> None:
    with pytest.raises(
        ConfigError, match="agent.env: rollout.agent=multi_turn needs an environment"
    ):
        Config(rollout=RolloutConfig(agent="multi_turn"))
    agent = AgentConfig(env="guess_number", max_turns=3, max_obs_tokens=10)
    assert compute_response_width(8, "multi_turn", agent) == 8 + 2 * 10
    assert compute_response_width(8, "single_turn", agent) == 8
    assert RolloutConfig(agent="my_agents.py:run").agent.startswith(
        "/"
    )  # paths made absolute for workers


@pytest.mark.parametrize("host", ["0.0.0.0", "192.168.1.7", "example.org", "::"])
def test_a_server_reachable_from_other_machines_must_be_asked_for(host: str) -> None:
    with pytest.raises(ConfigError, match="agent.server_host: .* agent.server_allow_remote=true"):
        AgentConfig(server_host=host)
    assert AgentConfig(server_host=host, server_allow_remote=True).server_host == host


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "localhost"])
def test_loopback_hosts_need_nothing_more(host: str) -> None:
    assert AgentConfig(server_host=host).server_host == host


@pytest.mark.parametrize("host", ["127.0.0.1", "::1"])
def test_the_endpoint_url_reaches_the_server_on_ipv4_and_ipv6(host: str) -> None:
    """agent.server_host=::1 is accepted (loopback), so the URL the agents get must reach
    it: the IPv6 address in brackets (issue 46: http://::1:PORT/v1, an InvalidURL in every
    episode). The openai client, as an agent calls it, gets the server's own 401 (no
    episode's key) instead of a connection error."""
    from openai import AuthenticationError, OpenAI

    from rlframe.agent_server.app import AgentServer
    from rlframe.data.tiny_model import build_tiny_tokenizer

    cfg = Config(rollout=RolloutConfig(agent="openai"), agent=AgentConfig(server_host=host))
    server = AgentServer(cfg, lambda batch: batch, build_tiny_tokenizer(), "tiny")
    server.start()
    try:
        assert server.base_url == f"http://{'[::1]' if host == '::1' else host}:{server.port}/v1"
        client = OpenAI(base_url=server.base_url, api_key="not-an-episode", max_retries=0)
        with pytest.raises(AuthenticationError):
            client.models.list()
        client.close()
    finally:
        server.stop()


def test_a_taken_server_port_fails_before_ray() -> None:
    import socket

    from rlframe.run.agent_preflight import check_server_port

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(
            ConfigError, match=f"agent.server_port: cannot listen on 127.0.0.1:{port}"
        ):
            check_server_port("127.0.0.1", port)
    check_server_port("127.0.0.1", port)  # free again
    check_server_port("127.0.0.1", 0)


def test_the_installed_openai_clients_lines_stay_out_of_the_driver_log(tmp_path: Path) -> None:
    """The openai package an agent imports, calling a local endpoint as an agent does: none
    of its transport's per-request INFO lines reach driver.log (issue 46: 1,986 lines in two
    steps, through ``httpx2`` / ``httpcore2``, which the quiet list did not name)."""
    import json
    import logging
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from openai import OpenAI

    from rlframe.observability.logs import route_driver_logs

    reply = {
        "id": "c",
        "object": "chat.completion",
        "created": 0,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "finish_reason": "stop",
                "message": {"role": "assistant", "content": "4"},
            }
        ],
    }

    class Endpoint(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["Content-Length"]))
            body = json.dumps(reply).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Endpoint)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    root = logging.getLogger()
    root_level = root.level
    routing = route_driver_logs(tmp_path, "warning")
    try:
        root.setLevel(logging.DEBUG)  # whatever reaches the handlers, not the root's threshold
        client = OpenAI(base_url=f"http://127.0.0.1:{server.server_port}/v1", api_key="x")
        for _ in range(3):
            answer = client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "2+2"}]
            )
            assert answer.choices[0].message.content == "4"
        client.close()
    finally:
        routing.close()
        root.setLevel(root_level)
        server.shutdown()
        server.server_close()
    text = (tmp_path / "logs" / "driver.log").read_text()
    assert "HTTP Request" not in text and "127.0.0.1" not in text, text[:2000]


def test_the_agents_http_client_lines_stay_out_of_the_driver_log(tmp_path: Path) -> None:
    import logging

    from rlframe.observability.logs import route_driver_logs

    before = logging.getLogger("httpx").level  # another test of this process may have set it
    routing = route_driver_logs(tmp_path, "warning")
    try:
        logging.getLogger("httpx").info("HTTP Request: POST http://127.0.0.1:1/v1 200 OK")
        logging.getLogger("httpx").warning("a client warning")
        logging.getLogger("rlframe").info("a line of the run's")
    finally:
        routing.close()
    text = (tmp_path / "logs" / "driver.log").read_text()
    assert "HTTP Request" not in text and "a client warning" in text
    assert "a line of the run's" in text
    assert logging.getLogger("httpx").level == before  # put back by close()
