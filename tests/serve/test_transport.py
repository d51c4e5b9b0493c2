"""How the server listens: HTTPS with --ssl-keyfile/--ssl-certfile (client certificates required with --ssl-ca-certs
and --ssl-cert-reqs 2), a Unix domain socket with --uds, the official OpenAI client on each; and the flags' errors,
which stop the server before its model loads. The --uds server also runs with --return-tokens-as-token-ids,
--enable-server-load-tracking (GET /load), --enable-force-include-usage, and vLLM's development routes
(POST /reset_prefix_cache)."""
import os
import socket
import ssl
import subprocess
import time

import httpx
import openai
import pytest

from nanograph import SamplingParams
from nanograph.cli import main
from nanograph.serve.command import bind_unix_socket, remove_socket_file, socket_file

from .server_process import ServerProcess, server_env

PROMPT = "The capital of France is"
GREEDY = SamplingParams(max_tokens=6, temperature=0)


def self_signed(folder, name: str) -> tuple[str, str]:
    """A certificate for 127.0.0.1 signed by its own key: (certificate, key) files."""
    cert, key = str(folder / f"{name}.pem"), str(folder / f"{name}.key")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", cert,
                    "-days", "2", "-subj", f"/CN={name}", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    return cert, key


def trusting(server_cert: str, client: tuple[str, str] | None = None) -> ssl.SSLContext:
    """A client's TLS settings: the server's certificate trusted, and the client's own certificate shown."""
    context = ssl.create_default_context(cafile=server_cert)
    if client is not None:
        context.load_cert_chain(*client)
    return context


def started(tmp_path_factory, *args, **kwargs) -> ServerProcess:
    return ServerProcess(tmp_path_factory.mktemp("serve") / "server.log", *args, **kwargs)


def stopped(server):
    code = server.stop()
    assert code == 0, f"nanograph serve exited with {code} after SIGTERM:\n{server.log()[-4000:]}"


def greedy_completion(client, model: str) -> str:
    return client.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0).choices[0].text


def test_https_with_client_certificates(tmp_path_factory, reference_llm):
    folder = tmp_path_factory.mktemp("certificates")
    server_cert, server_key = self_signed(folder, "server")
    client_cert, client_key = self_signed(folder, "client")
    server = started(tmp_path_factory, "--ssl-certfile", server_cert, "--ssl-keyfile", server_key,
                     "--ssl-ca-certs", client_cert, "--ssl-cert-reqs", str(int(ssl.CERT_REQUIRED)),
                     scheme="https", client={"verify": trusting(server_cert, (client_cert, client_key))})
    try:
        assert f"listening on https://127.0.0.1:{server.port}" in server.log()
        expected = reference_llm.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].text
        with httpx.Client(verify=trusting(server_cert, (client_cert, client_key)), timeout=60) as http, \
                openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", http_client=http,
                              max_retries=0) as client:
            assert greedy_completion(client, client.models.list().data[0].id) == expected
        # Plain HTTP, a client that does not trust the server's certificate, and one without a certificate of its
        # own are all turned away.
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://127.0.0.1:{server.port}/health", timeout=10)
        untrusting = ssl.create_default_context()
        untrusting.load_cert_chain(client_cert, client_key)
        with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
            httpx.get(server.base_url + "/health", verify=untrusting, timeout=10)
        with pytest.raises(httpx.HTTPError):
            httpx.get(server.base_url + "/health", verify=trusting(server_cert), timeout=10).raise_for_status()
        # The server goes on serving after them.
        assert httpx.get(server.base_url + "/health", verify=trusting(server_cert, (client_cert, client_key)),
                         timeout=10).status_code == 200
    finally:
        stopped(server)


def test_a_unix_domain_socket_and_token_ids_in_logprobs(tmp_path_factory, reference_llm):
    path = str(tmp_path_factory.mktemp("uds") / "nanograph.sock")
    # A socket file left by a server that is gone is replaced.
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as stale:
        stale.bind(path)
    transport = {"transport": httpx.HTTPTransport(uds=path)}
    server = started(tmp_path_factory, "--uds", path, "--return-tokens-as-token-ids", "--max-log-len", "100",
                     "--enable-server-load-tracking", "--enable-force-include-usage", "--enable-log-outputs",
                     "--disable-frontend-multiprocessing", client=transport,
                     env=server_env(NANOGRAPH_SERVER_DEV_MODE="1"))
    try:
        assert f"listening on unix:{path}" in server.log()
        with httpx.Client(transport=httpx.HTTPTransport(uds=path), timeout=60) as http, \
                openai.OpenAI(base_url="http://localhost/v1", api_key="unused", http_client=http,
                              max_retries=0) as client:
            expected = reference_llm.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].text
            model = client.models.list().data[0].id
            assert greedy_completion(client, model) == expected
            # --return-tokens-as-token-ids: logprobs name tokens by id unless a request says otherwise.
            fields = dict(model=model, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2)
            by_id = client.completions.create(**fields).choices[0].logprobs
            by_text = client.completions.create(**fields, extra_body={"return_tokens_as_token_ids": False}
                                                ).choices[0].logprobs
            tokenizer = reference_llm.get_tokenizer()
            assert [tokenizer.decode([int(token.removeprefix("token_id:"))]) for token in by_id.tokens] == \
                by_text.tokens
            assert all(key.startswith("token_id:") for top in by_id.top_logprobs for key in top)
            chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                                  max_tokens=3, temperature=0, logprobs=True, top_logprobs=1)
            assert all(entry.token.startswith("token_id:") for entry in chat.choices[0].logprobs.content)
            # --enable-force-include-usage: a stream without stream_options ends with its usage; GET /load counts
            # it while it runs; POST /reset_prefix_cache waits for no request to hold blocks.
            stream = client.completions.create(model=model, prompt=PROMPT, max_tokens=40, stream=True,
                                               extra_body={"ignore_eos": True})
            next(stream)
            assert http.get("http://localhost/load").json() == {"server_load": 1}
            assert http.post("http://localhost/reset_prefix_cache").status_code == 409
            chunks = list(stream)
            assert chunks[-1].usage.completion_tokens == 40 and not chunks[-1].choices
            deadline = time.monotonic() + 10  # the response's end reaches the count just after its last chunk
            while http.get("http://localhost/load").json() != {"server_load": 0}:
                assert time.monotonic() < deadline, "the finished stream is still counted"
                time.sleep(0.05)
            assert http.post("http://localhost/reset_prefix_cache").status_code == 200
        with socket.socket() as tcp:  # nothing on the TCP port
            assert tcp.connect_ex(("127.0.0.1", server.port)) != 0
        # A second server on the same path stops at once, naming it.
        with pytest.raises(SystemExit, match="a server already listens on --uds"):
            main(["serve", "--device", "cpu", "--uds", path])
    finally:
        stopped(server)
    assert not os.path.exists(path)  # the socket file goes with the server


@pytest.mark.parametrize("args, message", [
    (["--ssl-keyfile", "key.pem"], "--ssl-keyfile needs --ssl-certfile"),
    (["--ssl-ca-certs", "ca.pem"], "--ssl-ca-certs and --ssl-cert-reqs need HTTPS"),
    (["--ssl-certfile", "missing.pem"], "--ssl-certfile missing.pem: no such file, or not readable"),
    (["--default-chat-template-kwargs", '{"add_generation_prompt": false}'],
     "--default-chat-template-kwargs cannot set add_generation_prompt"),
    (["--enable-ssl-refresh"], "--enable-ssl-refresh is not supported"),
])
def test_flag_errors_stop_the_server_before_its_model_loads(tmp_path, monkeypatch, args, message):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit, match=message):
        main(["serve", "--device", "cpu", "--model", str(tmp_path / "no-such-model"), *args])


def test_a_certificate_and_a_key_that_do_not_match_are_one_error_line(tmp_path):
    cert, key = self_signed(tmp_path, "one")
    _, other_key = self_signed(tmp_path, "two")
    with pytest.raises(SystemExit, match="cannot use --ssl-certfile"):
        main(["serve", "--device", "cpu", "--ssl-certfile", cert, "--ssl-keyfile", other_key])
    with pytest.raises(SystemExit, match="--ssl-cert-reqs 2 checks client certificates, which needs --ssl-ca-certs"):
        main(["serve", "--device", "cpu", "--ssl-certfile", cert, "--ssl-keyfile", key, "--ssl-cert-reqs", "2"])


def test_a_uds_path_that_is_not_a_socket_is_one_error_line(tmp_path):
    path = tmp_path / "file"
    path.write_text("not a socket")
    with pytest.raises(SystemExit, match="exists and is not a socket"):
        main(["serve", "--device", "cpu", "--uds", str(path)])
    assert path.read_text() == "not a socket"


def test_a_uds_socket_is_taken_from_its_binding_on(tmp_path):
    """The socket listens as soon as it is bound (while the model would load), so a second server on the path stops
    rather than replacing it; the first one's exit removes only its own file."""
    path = str(tmp_path / "s.sock")
    first = bind_unix_socket(path)
    first_file = socket_file(path)
    try:
        with pytest.raises(SystemExit, match="a server already listens on --uds"):
            bind_unix_socket(path)
    finally:
        first.close()
    second = bind_unix_socket(path)  # the first is gone: its file is replaced
    try:
        remove_socket_file(path, first_file)  # the first server's exit
        assert os.path.exists(path)
        remove_socket_file(path, socket_file(path))
        assert not os.path.exists(path)
    finally:
        second.close()
